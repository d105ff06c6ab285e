"""Conformance of every harness / wire API / chat family combination Miles supports (``miles bench
conformance``): each row runs real episodes of a harness against a real session server and engine,
then checks what the session recorded: every turn token-exact, no spurious fork, no tool call
dropped silently. See docs/benchmarks/conformance.md."""
