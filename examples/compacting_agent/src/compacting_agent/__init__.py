"""Example agent for Miles: a multi-turn ``openai``-client agent that compacts its context every few
turns (:mod:`compacting_agent.agent`), so its episode is a trajectory graph of several branches."""
