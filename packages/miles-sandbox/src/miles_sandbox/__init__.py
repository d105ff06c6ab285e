"""Sandboxed tool execution for Miles agents: a bubblewrap sandbox service, its pool and client."""
