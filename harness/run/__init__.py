"""Running cases on ranks, by role: ``case/`` one case on one rank (in lockstep with the others),
``world/`` process groups, the store and device decisions, ``hosts/`` where ranks come from (a torchrun
launch or a warm pool), ``guards/`` keeping a bad target contained, ``audit/`` ``harness.audit`` on a
user's own job."""
