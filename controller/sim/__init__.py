"""The simulated P/D cluster: engines, KV links, routers, vLLM metrics, scenarios (DESIGN §8)."""
