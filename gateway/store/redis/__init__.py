"""``--store redis``: the stores of ``gateway/store/`` kept in Redis, shared by every gateway
replica of a deployment (docs/deploy-state.md has the keys, limits and failure behaviour)."""
