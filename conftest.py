"""pytest setup for this repository: the clipcheck plugin (``world_size`` marker, warm worlds) and
pytester for testing the plugin itself. Installed elsewhere, the plugin comes via its pytest11 entry
point under the same name, so it is never registered twice."""

pytest_plugins = ["harness.pytest_plugin", "pytester"]
