"""``harness.audit`` on one rank of the user's own job (used only by ``harness.auditor``)."""
