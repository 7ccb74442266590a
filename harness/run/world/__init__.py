"""One rank's process groups and store (``DistWorld``), and the device and torch-version decisions."""
