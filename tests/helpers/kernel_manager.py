"""Drive a kernel of a jupyter_server kernel manager in the test's own process: wait for
a state the manager sees, run a cell that keeps the kernel busy."""

from __future__ import annotations

import asyncio


async def wait_state(km, kid, state, timeout=30):
    for _ in range(int(timeout / 0.05)):
        if km.get_kernel(kid).execution_state == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"kernel never became {state}")


async def start_cell(km, kid, code):
    """Run ``code`` in kernel ``kid`` and wait until the kernel manager sees it busy.

    The manager's own view is waited on first: a cell sent before its iopub subscription
    is up would go busy and idle unseen on a loaded machine. A kernel_info request makes
    the kernel publish busy/idle; once the manager has seen that idle it is listening."""
    client = km.get_kernel(kid).client()
    client.start_channels()
    for _ in range(600):
        client.kernel_info()
        await asyncio.sleep(0.05)
        if km.get_kernel(kid).execution_state == "idle":
            break
    else:
        raise AssertionError("the kernel manager never saw the kernel idle")
    client.execute(code)
    await wait_state(km, kid, "busy")
    return client
