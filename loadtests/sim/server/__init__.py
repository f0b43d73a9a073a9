"""The simulated engine's HTTP edge: vLLM's OpenAI-compatible API over a SimEngine."""

from loadtests.sim.server.app import SimState, create_sim_app, run_sim_server

__all__ = ["SimState", "create_sim_app", "run_sim_server"]
