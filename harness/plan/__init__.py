"""Planning: a matrix and a world size become the cases to run (names resolved to scenarios and targets,
combinations dropped with their reasons), and a project's ``[tool.clipcheck]`` defaults. It sits above
``cases`` (what a case is) and ``targets`` (what is judged), and below whatever runs the plan."""
