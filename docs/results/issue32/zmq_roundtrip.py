"""A DEALER's round trip to a ROUTER echo (a 200-byte metadata frame and a 20 KB payload frame),
the client's thread CPU and wall time per round trip in microseconds: through pyzmq's asyncio
socket (as ``wire.intake.AsyncIntakeClient``), and through a plain socket whose file descriptor
the loop watches (a send without a future, replies read until none is left). Under uvloop, 20,000
round trips each, twice, alternating.
Usage: .venv/bin/python docs/results/issue32/zmq_roundtrip.py OUT.json"""

import asyncio
import json
import sys
import threading
import time

import uvloop
import zmq
import zmq.asyncio

ROUND_TRIPS = 20000
FRAMES = [b"x" * 200, b"y" * 20000]


def echo(endpoint: str, stop: threading.Event) -> None:
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(endpoint)
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                socket.send_multipart(frames)
    socket.close()


def per_round_trip(started_cpu: float, started_wall: float) -> dict:
    return {
        "cpu_us": (time.thread_time() - started_cpu) / ROUND_TRIPS * 1e6,
        "wall_us": (time.monotonic() - started_wall) / ROUND_TRIPS * 1e6,
    }


async def through_asyncio_socket(endpoint: str) -> dict:
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    cpu, wall = time.thread_time(), time.monotonic()
    for _ in range(ROUND_TRIPS):
        await socket.send_multipart(FRAMES, copy=False)
        await socket.recv_multipart()
    result = per_round_trip(cpu, wall)
    socket.close()
    return result


async def through_descriptor(endpoint: str) -> dict:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    loop = asyncio.get_running_loop()
    descriptor = socket.getsockopt(zmq.FD)
    waiting: list[asyncio.Future] = []

    def readable() -> None:
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = socket.recv_multipart(zmq.NOBLOCK)
            waiting.pop(0).set_result(frames)

    loop.add_reader(descriptor, readable)
    cpu, wall = time.thread_time(), time.monotonic()
    for _ in range(ROUND_TRIPS):
        reply = loop.create_future()
        waiting.append(reply)
        socket.send_multipart(FRAMES, zmq.NOBLOCK, copy=False)
        if socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the send may have taken the edge
            loop.call_soon(readable)
        await reply
    result = per_round_trip(cpu, wall)
    loop.remove_reader(descriptor)
    socket.close()
    return result


def main(out: str) -> None:
    stop, endpoint = threading.Event(), "tcp://127.0.0.1:5599"
    threading.Thread(target=echo, args=(endpoint, stop), daemon=True).start()
    time.sleep(0.2)
    runs = []
    for _ in range(2):
        runs.append({"asyncio_socket": uvloop.run(through_asyncio_socket(endpoint))})
        runs[-1]["descriptor"] = uvloop.run(through_descriptor(endpoint))
        print(runs[-1])
    stop.set()
    with open(out, "w") as file:
        json.dump(runs, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
