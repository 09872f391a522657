"""The one door to NIXL: the agent wrapper and its handles, statuses as typed errors, UCX settings, warm-up."""
