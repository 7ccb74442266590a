"""One case on one rank, in lockstep with the others: build, inject, measure, call, effects, records."""
