"""A completion request's way through the router, one stage a module, in this order:

- `read` and `intake`: the body read within its limits, checked and sized (the refusal rows
  that need no engine), with its TTFT budget and deadline: the request record
  (`router/request.py`);
- `classify`: where it stands (tenant, class, the share of its budget it is judged
  against, its order among waiters);
- `gate`: whether this router takes work now (leadership, whole-wave maintenance,
  monitoring-degraded) and which engines can serve the route;
- `judge`: the admission policy's plan (`policies/`), waiting while the budget allows when
  no engine keeps its streams' pace;
- `place`: a seat on an engine through the lease (`admission`), the relay (`relay`), and
  another engine when one answers 429.

A stage that refuses a request raises the client's error saying how the request ended
(`ApiError.ended`, a row of `router/endings.py`); `flow` counts it once, in its `Ending`.
"""
