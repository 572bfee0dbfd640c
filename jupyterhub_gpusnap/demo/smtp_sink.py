"""A local SMTP sink for the demo: prints each message's headers and text, saves it as .eml."""

from __future__ import annotations

import argparse
import asyncio
import email
import email.policy
import time
from pathlib import Path

from aiosmtpd.controller import Controller


class Sink:
    def __init__(self, folder: Path):
        self.folder = folder

    async def handle_DATA(self, server, session, envelope):
        msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
        name = (
            self.folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{len(list(self.folder.iterdir()))}.eml"
        )
        name.write_bytes(envelope.content)
        body = msg.get_body(preferencelist=("plain",))
        print(f"\n=== email to {', '.join(envelope.rcpt_tos)}: {msg['Subject']}  (saved {name})")
        print(body.get_content() if body else "")
        return "250 Message accepted"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8025)
    p.add_argument("--dir", default="mail")
    args = p.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    controller = Controller(Sink(folder), hostname="127.0.0.1", port=args.port)
    controller.start()
    try:
        asyncio.run(asyncio.Event().wait())
    except KeyboardInterrupt:
        pass
    finally:
        controller.stop()


if __name__ == "__main__":
    main()
