"""A run's endpoint for agents, assembled: its token, its server, its driver, its address file.

The token: the one the run was given (`Runner(agent_token=...)`: the dashboard gives the run
owner's API token), else the `RLPILOT_AGENT_TOKEN` environment variable (a command-line user sets
their own), else a new random one. The address (and a generated token, never one given) is
written to RUN_DIR/agents.json, readable by its owner only, for the agents to read:

    {"base_url": "http://127.0.0.1:PORT/v1", "token": "...", "token_from": "generated"}
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from trainer.agents.chat import ChatFormat
from trainer.agents.driver import AgentDriver
from trainer.agents.server import AgentServer
from trainer.agents.sessions import Sessions
from trainer.rollout.base import sampling_params

TOKEN_ENV = "RLPILOT_AGENT_TOKEN"
ADDRESS_FILE = "agents.json"


def max_positions(model, fallback: int) -> int:
    """The positions an engine slot holds for agents' conversations: the model's own."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return max(int(n), fallback) if n else fallback


def build(cfg, engine, tokenizer, scorer, run_dir: str | Path, max_seq_len: int,
          current_cfg, token: str | None = None) -> AgentDriver:
    """The driver of an agents run, its endpoint listening (`current_cfg()`: the run's config now,
    whose rollout.temperature and max_response_len a new episode takes)."""
    source = "run" if token else TOKEN_ENV
    token = (token or os.environ.get(TOKEN_ENV, "")).strip()
    generated = not token
    token = token or secrets.token_urlsafe(24)
    sessions = Sessions(ChatFormat.for_config(cfg, tokenizer),
                        lambda: sampling_params(current_cfg()), max_seq_len)
    server = AgentServer(sessions, token, cfg.episode.agent_port, model=cfg.model.path).start()
    address = {"base_url": server.base_url, "token_from": "generated" if generated else source}
    if generated:
        address["token"] = token
    path = Path(run_dir) / ADDRESS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(address, f)
    return AgentDriver(engine, tokenizer, scorer, sessions, server)


def read_address(run_dir: str | Path) -> dict:
    """RUN_DIR/agents.json: the endpoint's base_url (and its token when it was generated)."""
    return json.loads((Path(run_dir) / ADDRESS_FILE).read_text())
