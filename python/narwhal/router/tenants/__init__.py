"""Tenants: who a request is for (its client key), and what that tenant may use.

- `limits`: requests a minute, tokens a minute and requests at once, per tenant, over a
  sliding minute; 429 `tenant_rate_limited` with `Retry-After` past one.
- `registry`: the tenants named in `auth.api_keys`, by key, and the stage that lets a
  request in (or not) and settles what it used when it ends.
"""
