"""Example agent for Miles: the official ``openai`` client plus a calculator tool
(:mod:`calculator_agent.agent`). Importing the package imports neither: ``miles plugins`` and every
process of a run load the plugin module, and only the driver runs the agent."""
