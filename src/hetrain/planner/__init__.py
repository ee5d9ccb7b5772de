"""The planner: cluster + profile + options -> Plan (pure Python, no torch).

Modules: formation (which devices form virtual workers), stage_cost (stage
tables with cost-balanced recomputation), partition (cuts over an ordered VW),
vw (orders, micro-batching), sync (segment all-reduce cost), shards (a plan's
sharded state, each segment's mode), search (the whole).
"""

from hetrain.planner.search import PlannerError, PlannerOptions, plan, search

__all__ = ["PlannerError", "PlannerOptions", "plan", "search"]
