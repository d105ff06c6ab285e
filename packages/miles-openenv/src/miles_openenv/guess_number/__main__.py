"""Serve the ``guess_number`` OpenEnv environment on loopback: ``python -m miles_openenv.guess_number --port 8000``."""

from __future__ import annotations

import argparse

import uvicorn

from miles_openenv.guess_number import create_guess_number_app

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_guess_number_app(), host=args.host, port=args.port, log_level="warning")
