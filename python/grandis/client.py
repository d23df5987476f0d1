"""A client of the coordinator's REST API (docs/openapi.yaml): jobs, the cluster, the event
stream of a job and its checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import requests

# How often a broken event stream is reopened before `follow` gives up (the CLI's rule).
FOLLOW_RETRIES = 40
FOLLOW_PAUSE_S = 0.25

TERMINAL_STATES = ("succeeded", "failed", "cancelled")

JobSpec = Union[Dict[str, Any], str, os.PathLike]


class GrandisError(Exception):
    """An error the coordinator answered with (a 4xx or 5xx and its JSON body), or a transport
    failure (`status` None).

    `code` is the stable machine-readable code (`invalid_job`, `not_found`, ...), `message`
    the coordinator's text naming the problem and `fields` the per-field problems of an
    invalid job, each `{"field": ..., "message": ...}`."""

    def __init__(
        self,
        message: str,
        status: Optional[int] = None,
        code: Optional[str] = None,
        fields: Optional[List[Dict[str, str]]] = None,
    ):
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields or []
        where = f"{status} {code}: " if status is not None else ""
        detail = "".join(f"\n  {f.get('field')}: {f.get('message')}" for f in self.fields)
        super().__init__(f"{where}{message}{detail}")


class Client:
    """The coordinator at `url` (e.g. ``http://10.0.0.1:7700``), with its bearer `token`.

    Every call raises :class:`GrandisError` on an error status or when the coordinator
    cannot be reached; `timeout` bounds each request (not the event stream)."""

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    # ---- jobs ----------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Dict[str, Any]:
        """Submits a job: a dict (sent as JSON) or the path of a TOML job file (sent as
        TOML, as `grandis submit` does). Returns the job's status (its `id` among them)."""
        if isinstance(spec, dict):
            return self._call("POST", "/v1/jobs", json=spec)
        body = Path(spec).read_bytes()
        return self._call(
            "POST", "/v1/jobs", data=body, headers={"Content-Type": "application/toml"}
        )

    def job(self, job_id: int) -> Dict[str, Any]:
        """A job's status with its epoch history."""
        return self._call("GET", f"/v1/jobs/{int(job_id)}")

    def jobs(self) -> List[Dict[str, Any]]:
        """Every job, in id order (without their epoch history)."""
        return self._call("GET", "/v1/jobs")

    def cancel(self, job_id: int) -> Dict[str, Any]:
        """Cancels a job that has not ended; returns it, cancelled."""
        return self._call("DELETE", f"/v1/jobs/{int(job_id)}")

    def cluster(self) -> Dict[str, Any]:
        """The cluster: servers, their heads and daemons."""
        return self._call("GET", "/v1/cluster")

    def download_checkpoint(self, job_id: int, path: Union[str, os.PathLike]) -> int:
        """Writes the job's latest checkpoint (safetensors) to `path` and returns the epoch it
        was written after. The file appears only once complete."""
        resp = self._send("GET", f"/v1/jobs/{int(job_id)}/checkpoint", stream=True)
        epoch = int(resp.headers.get("x-grandis-checkpoint-epoch", "0"))
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in resp.iter_content(chunk_size=1 << 20):
                    out.write(chunk)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return epoch

    # ---- following a job -----------------------------------------------------------------

    def events(self, job_id: int) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """The job's server-sent events as `(event, data)` pairs (`state`, `progress`,
        `end`), until the stream closes. One connection: :meth:`follow` reconnects."""
        resp = self._send(
            "GET",
            f"/v1/jobs/{int(job_id)}/events",
            stream=True,
            headers={"Accept": "text/event-stream"},
            timeout=(self.timeout, None),
        )
        event, data = "", []
        with resp:
            for raw in resp.iter_lines(decode_unicode=True):
                line = raw if raw is not None else ""
                if line:
                    if line.startswith("event:"):
                        event = line[len("event:"):].strip()
                    elif line.startswith("data:"):
                        value = line[len("data:"):]
                        data.append(value[1:] if value.startswith(" ") else value)
                    continue
                if event and data:
                    try:
                        yield event, json.loads("\n".join(data))
                    except ValueError:
                        pass
                event, data = "", []

    def follow(
        self,
        job_id: int,
        progress: bool = True,
        on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
        on_state: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> Dict[str, Any]:
        """Follows a job until it ends and returns its final status. Each epoch is reported
        once (to `on_epoch`, and on a progress bar unless `progress` is False; a retry that
        resumes from a checkpoint reports the epochs it repeats again), each state change to
        `on_state`. A broken stream is reopened, as `grandis submit --follow` does."""
        bar = None
        last_epoch = 0
        failures = 0
        try:
            while True:
                try:
                    for event, data in self.events(job_id):
                        failures = 0
                        if progress and bar is None:
                            bar = _progress_bar(job_id, self._epochs_of(job_id))
                        if event == "progress":
                            epoch = int(data.get("epoch", 0))
                            if epoch <= last_epoch:
                                continue
                            if bar is not None:
                                bar.update(epoch - last_epoch)
                                bar.set_postfix(
                                    loss=f"{data.get('loss', 0):.4f}",
                                    val_acc=f"{data.get('val_acc', 0):.4f}",
                                )
                            last_epoch = epoch
                            if on_epoch:
                                on_epoch(data)
                        elif event == "state":
                            retry = data.get("retry")
                            if retry and data.get("state") == "queued":
                                last_epoch = min(last_epoch, int(retry.get("resume_epoch", 0)))
                                if bar is not None:
                                    bar.n = last_epoch
                                    bar.refresh()
                            if on_state:
                                on_state(data)
                        elif event == "end":
                            return data
                except GrandisError as e:
                    if e.status is not None:
                        raise
                    failures += 1
                    if failures > FOLLOW_RETRIES:
                        raise
                except requests.RequestException:
                    failures += 1
                    if failures > FOLLOW_RETRIES:
                        raise GrandisError(f"{self.url}: the event stream keeps breaking")
                # The stream ended without an `end` event (a coordinator restart?): ask.
                try:
                    status = self.job(job_id)
                    if status["state"] in TERMINAL_STATES:
                        return status
                except GrandisError as e:
                    if e.status is not None:
                        raise
                time.sleep(FOLLOW_PAUSE_S)
        finally:
            if bar is not None:
                bar.close()

    def wait(self, job_id: int, timeout: float = 600.0, poll: float = 0.2) -> Dict[str, Any]:
        """Polls a job until it ends (or raises TimeoutError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.job(job_id)
            if status["state"] in TERMINAL_STATES:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {status['state']} after {timeout} s")
            time.sleep(poll)

    # ---- plumbing ------------------------------------------------------------------------

    def _epochs_of(self, job_id: int) -> Optional[int]:
        try:
            return int(self.job(job_id)["spec"].get("epochs"))
        except (GrandisError, KeyError, TypeError, ValueError):
            return None

    def _send(self, method: str, path: str, timeout: Any = None, **kw: Any) -> requests.Response:
        try:
            resp = self.session.request(
                method, self.url + path, timeout=timeout or self.timeout, **kw
            )
        except requests.RequestException as e:
            raise GrandisError(f"{method} {self.url}{path}: {e}") from e
        if resp.status_code >= 400:
            raise _error_of(resp)
        return resp

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._send(method, path, **kw)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as e:
            raise GrandisError(
                f"{method} {path}: the coordinator answered {resp.status_code} with a body "
                f"that is not JSON",
                status=resp.status_code,
            ) from e


def _error_of(resp: requests.Response) -> GrandisError:
    """The coordinator's error body (`{"code", "error", "fields"?}`) as an exception."""
    try:
        body = resp.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    message = body.get("error") or resp.text.strip() or resp.reason or "error"
    return GrandisError(
        str(message),
        status=resp.status_code,
        code=body.get("code"),
        fields=body.get("fields") if isinstance(body.get("fields"), list) else None,
    )


def _progress_bar(job_id: int, epochs: Optional[int]):
    from tqdm.auto import tqdm

    return tqdm(total=epochs, desc=f"job {job_id}", unit="epoch")
