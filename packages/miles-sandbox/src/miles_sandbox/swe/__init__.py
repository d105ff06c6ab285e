"""mini-swe-agent on the sandbox service (extra ``swe``): its ``Environment`` implemented against a
leased sandbox, its model pointed at the session server, run as the Miles agent ``mini_swe_agent``."""
