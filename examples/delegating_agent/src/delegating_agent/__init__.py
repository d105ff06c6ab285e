"""Example agent for Miles: a main agent (``openai`` client) that hands the task to a sub-agent
(``anthropic`` client) in a session of its own, in the same episode (:mod:`delegating_agent.agent`)."""
