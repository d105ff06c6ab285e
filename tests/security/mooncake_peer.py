"""A Mooncake peer that is not part of the run: its own transfer engine, no token. The security tests
start it as a separate process (``python mooncake_peer.py``) and drive it over stdin, one command a
line, one JSON answer a line:

    read <session> <address> <n>       -> {"status": <transfer_sync_read's>, "hex": <the bytes read>}
    write <session> <address> <n> <b>  -> {"status": <transfer_sync_write's>} (n bytes of value b)

It does what any process that can reach a Mooncake port can do: read or write a registered buffer
through the data port (its address is in the segment description the handshake port hands anyone,
``TransferEngine.get_first_buffer_address``; the tests pass it on from the trainer's request).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def main() -> None:
    import torch
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("the peer's transfer engine did not start")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, session, *args = line.split()
        if command == "read":
            address, size = int(args[0]), int(args[1])
            mine = torch.zeros(size, dtype=torch.uint8)
            status = engine.transfer_sync_read(session, mine.data_ptr(), address, size)
            answer = {"status": status, "hex": mine.numpy().tobytes().hex()}
        elif command == "write":
            address, size, value = int(args[0]), int(args[1]), int(args[2])
            mine = torch.full((size,), value, dtype=torch.uint8)
            answer = {"status": engine.transfer_sync_write(session, mine.data_ptr(), address, size)}
        else:
            answer = {"error": f"unknown command {command}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
