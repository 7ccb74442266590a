"""What pyproject.toml cannot say: the repository's top-level ``scenarios/`` folder ships as
``harness.scenarios``, with every framework folder under it as a subpackage, so that a user's own
``scenarios/`` folder can never shadow it (harness/targets/builtin_scenarios.py). setuptools cannot
discover packages mapped from another folder, so they are listed here from the tree: adding a
framework folder needs no packaging change (tests/test_packaging.py checks the wheel)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["harness", "harness.*"])
    + ["harness.scenarios"]
    + [f"harness.scenarios.{name}" for name in find_packages("scenarios")],
    package_dir={"harness.scenarios": "scenarios"},
)
