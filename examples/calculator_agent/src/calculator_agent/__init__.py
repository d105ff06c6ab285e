"""Example agent for Miles: the official ``openai`` client plus a calculator tool."""

from calculator_agent.agent import CALCULATOR_TOOL, run_agent

__all__ = ["CALCULATOR_TOOL", "run_agent"]
