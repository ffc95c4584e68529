"""The fleet while the router runs: engines joining and leaving.

- `membership`: the one owner of which engines serve: add, drain, remove (with hooks for
  the policy, the relay and the metrics).
- `rules`: what a runtime engine may name: key variables from a list, allowed addresses.
- `spec`: an engine described at runtime, checked as the config file's entries are.
- `admin`: `/admin/engines` (list, add, drain); with `ha`, edits go through etcd.
- `etcd_source`: engines registered under an etcd prefix (and the admin edits of `ha`).
- `dns_source`: engines at the addresses a DNS name resolves to.
- `reload`: the config file read again (SIGHUP, POST /admin/reload).
- `wiring`: the parts above built once for a router, with who hears of membership changes.
"""
