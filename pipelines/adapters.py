"""A served model's LoRA adapters by name: the declared ones (`[[models.loras]]`) and the ones loaded at run time
(`POST /v1/loras`, from the model's `lora_dirs` only), with

* leases: a request holds its adapters from admission to its end. Unloading one (`DELETE /v1/loras/{name}`)
  takes its name away at once, and its weights once the last request using it has ended, so a request finishes
  with the adapters it started with;
* a byte budget (`lora_budget_mb`): the adapters resident in the model form an LRU; loading one past the budget
  evicts the least recently used ones no running request holds, and a request naming an evicted adapter has it
  loaded again from its file by the stage that first needs it (`ensure`, on that stage's worker, never on the
  event loop);
* identity: every load of a name gets a new generation, which enters the cache keys (prompt embeddings, prefix KV)
  so a name loaded again from another file never meets the old file's cached results.

Loading and unloading hold the model's AdapterGate alone (stages/lora.py); every forward of the model holds it
shared.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.image_request import RequestError, check_lora
from stages.events import CapacityError
from stages.lora import AdapterGate, Use

if TYPE_CHECKING:
    from pipelines.config import LoraSpec

log = logging.getLogger(__name__)


class AdapterConflict(RequestError):
    """A run-time load names an adapter the model serves already (or is still unloading): HTTP 409."""


class PathRefused(RequestError):
    """A run-time load names a file outside the model's `lora_dirs` (or the model has none): HTTP 403."""


@dataclass
class _Adapter:
    spec: LoraSpec
    generation: int
    bytes: int = 0
    resident: bool = False
    refs: int = 0  # requests holding it
    retired: bool = False  # unloaded by name: its weights go when its last request ends


class Adapters(AdapterGate):
    """`load(spec)` puts an adapter's weights into the model and returns their bytes; `unload(name)` takes them
    out (the family's, holding the gate alone)."""

    def __init__(self, model: str, load: Callable[[LoraSpec], int], unload: Callable[[str], None], *,
                 budget_bytes: int | None = None, dirs: Sequence[Path] = ()):
        super().__init__()
        self.model = model
        self._load, self._unload = load, unload
        self.budget_bytes, self.dirs = budget_bytes, tuple(dirs)
        self.max_resident: int | None = None  # adapters resident at once (a language model's LoRA slots)
        self._lock = threading.Lock()  # the bookkeeping below; taken inside the gate, never around it
        self._adapters: dict[str, _Adapter] = {}  # name -> its current load (retired ones until they go)
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._generations = itertools.count(1)
        self.loads = 0  # loads into the model: each add, and each reload of an evicted adapter

    # -- what requests see ---------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(name for name, a in self._adapters.items() if not a.retired)

    def resolve(self, lora) -> tuple[tuple[str, float], ...]:
        """A request's `lora` entries ((name, scale or None), ...) as (adapter, weight) pairs, each entry's declared
        scale where it names none: checked (check_lora); an adapter the model does not serve is a 400 naming the
        entry and listing the ones it does."""
        check_lora(lora)
        names = self.names()
        out = []
        for i, (name, scale) in enumerate(lora):
            with self._lock:
                adapter = self._adapters.get(name)
            if adapter is None or adapter.retired:
                raise RequestError(f"lora[{i}].name", f"model {self.model} has no LoRA {name!r}; its adapters: "
                                                      f"{sorted(names)}", code="unknown_lora")
            out.append((name, float(adapter.spec.scale if scale is None else scale)))
        return tuple(out)

    def identity(self, use: Use) -> tuple:
        """`use` as cache keys see it: each adapter's name with the generation of its current load."""
        with self._lock:
            return tuple((f"{name}#{self._adapters[name].generation if name in self._adapters else 0}", weight)
                         for name, weight in use)

    def lease(self, names: Sequence[str]) -> Callable[[], None]:
        """Hold `names` for one request (they stay loaded and resident until the returned release is called).
        An adapter unloaded since the request was checked is a 400 like an unknown one; holding more bytes of
        adapters at once than the budget allows is a 429 (retry when running requests end)."""
        names = tuple(dict.fromkeys(names))
        if not names:
            return lambda: None
        with self._lock:
            live = sorted(n for n, a in self._adapters.items() if not a.retired)
            for name in names:
                if name not in live:
                    raise RequestError("lora", f"model {self.model} has no LoRA {name!r} (it was unloaded); its "
                                               f"adapters: {live}", code="unknown_lora")
            if self.budget_bytes is not None:
                held = {n for n, a in self._adapters.items() if a.refs} | set(names)
                need = sum(self._adapters[n].bytes for n in held)
                if need > self.budget_bytes:
                    raise CapacityError(f"model {self.model}: running requests hold {need} bytes of LoRA adapters "
                                        f"with this one, over its budget of {self.budget_bytes}; retry shortly")
            for name in names:
                self._adapters[name].refs += 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            gone = []
            with self._lock:
                for name in names:
                    adapter = self._adapters[name]
                    adapter.refs -= 1
                    if adapter.retired and not adapter.refs:
                        gone.append(name)
            if gone:  # off the thread that ended the request (it may be a worker inside a forward)
                threading.Thread(target=self._drop, args=(gone,), name=f"lora-unload-{self.model}",
                                 daemon=True).start()
        return release

    def ensure(self, names: Sequence[str]) -> None:
        """Before a forward with `names`: reload the evicted ones (holding the gate alone), mark all as used."""
        with self._lock:
            missing = [n for n in names if n in self._adapters and not self._adapters[n].resident]
            for name in names:
                if name in self._resident:
                    self._resident.move_to_end(name)
        if not missing:
            return
        with self.change():
            for name in missing:
                adapter = self._adapters.get(name)
                if adapter is None or adapter.resident:  # another stage reloaded it meanwhile
                    continue
                log.info("model %s: reloading LoRA %s (%s), evicted earlier", self.model, name, adapter.spec.path)
                self._make_room(keep=set(names))
                self._put(name, adapter)
            self._evict(keep=set(names))

    # -- loading and unloading -----------------------------------------------------------
    def add(self, spec: LoraSpec) -> None:
        """Load `spec` into the model. A name it serves already is a 409; a file that is not a LoRA of this model
        a 400 naming the file; an adapter larger than the budget a 400."""
        with self._lock:
            current = self._adapters.get(spec.name)
            if current is not None:
                state = "is still unloading (requests use it)" if current.retired else "is loaded"
                raise AdapterConflict("name", f"model {self.model}: a LoRA named {spec.name!r} {state}; unload it "
                                              "first or pick another name", code="lora_exists")
            adapter = _Adapter(spec, next(self._generations))
            self._adapters[spec.name] = adapter
        try:
            with self.change():
                self._make_room(keep={spec.name})
                self._put(spec.name, adapter)
                if self.budget_bytes is not None and adapter.bytes > self.budget_bytes:
                    self._take_out(spec.name, adapter)
                    raise RequestError("path", f"lora {spec.name} ({spec.path}): {adapter.bytes} bytes, larger than "
                                               f"model {self.model}'s LoRA budget of {self.budget_bytes} bytes",
                                       code="lora_too_large")
                self._evict(keep={spec.name})
        except BaseException:
            with self._lock:
                self._adapters.pop(spec.name, None)
            raise

    def remove(self, name: str) -> bool:
        """Take `name` away from new requests; its weights go now, or when the last request using it ends (False).
        An adapter the model does not serve is a 404."""
        from pipelines.image_request import ModelNotFound

        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.retired:
                raise ModelNotFound(f"model {self.model} has no LoRA {name!r}; its adapters: {sorted(self.names())}")
            adapter.retired = True
            now = not adapter.refs
        if now:
            self._drop([name])
        return now

    def file_in_dirs(self, path: str) -> str:
        """A run-time load's `path`: a file or directory inside one of the model's `lora_dirs` (relative paths are
        looked up in each, in order), symlinks resolved. Elsewhere: a 403."""
        if not self.dirs:
            raise PathRefused("model", f"model {self.model} loads no LoRA at run time: its config names no "
                                       "lora_dirs", code="lora_dirs_unset")
        candidates = [Path(path)] if Path(path).is_absolute() else [d / path for d in self.dirs]
        for candidate in candidates:
            real = candidate.resolve()
            if any(real.is_relative_to(d.resolve()) for d in self.dirs) and real.exists():
                return str(real)
        raise PathRefused("path", f"path {path!r} is not a file or directory inside model {self.model}'s lora_dirs "
                                  f"{[str(d) for d in self.dirs]}", code="path_not_allowed")

    def describe(self) -> list[dict]:
        with self._lock:
            return [{"name": name, "path": a.spec.path, "scale": a.spec.scale, "resident": a.resident,
                     "bytes": a.bytes, "requests": a.refs} for name, a in self._adapters.items() if not a.retired]

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(self._adapters[n].bytes for n in self._resident)

    # -- internals (holding the gate alone) ------------------------------------------------
    def _put(self, name: str, adapter: _Adapter) -> None:
        adapter.bytes = self._load(adapter.spec)
        with self._lock:
            adapter.resident = True
            self._resident[name] = None
            self.loads += 1

    def _take_out(self, name: str, adapter: _Adapter) -> None:
        self._unload(name)
        with self._lock:
            adapter.resident = False
            self._resident.pop(name, None)

    def _make_room(self, keep: set[str]) -> None:
        """Below max_resident before a load: the least recently used adapter no request holds goes; when every
        resident one is held, a 429 (retry when requests end)."""
        if self.max_resident is None:
            return
        while True:
            with self._lock:
                if len(self._resident) < self.max_resident:
                    return
                victim = next((n for n in self._resident if n not in keep and not self._adapters[n].refs), None)
            if victim is None:
                raise CapacityError(f"model {self.model}: all {self.max_resident} LoRA slots (max_loras) hold adapters "
                                    "that running requests use; retry shortly")
            log.info("model %s: evicting LoRA %s for a free slot", self.model, victim)
            self._take_out(victim, self._adapters[victim])

    def _evict(self, keep: set[str]) -> None:
        """Unload least recently used adapters that no request holds until the resident ones fit the budget."""
        if self.budget_bytes is None:
            return
        while True:
            with self._lock:
                total = sum(self._adapters[n].bytes for n in self._resident)
                victim = next((n for n in self._resident if n not in keep and not self._adapters[n].refs), None)
            if total <= self.budget_bytes or victim is None:
                return
            log.info("model %s: evicting LoRA %s (resident %d bytes, budget %d)", self.model, victim, total,
                     self.budget_bytes)
            self._take_out(victim, self._adapters[victim])

    def _drop(self, names: list[str]) -> None:
        with self.change():
            for name in names:
                with self._lock:
                    adapter = self._adapters.get(name)
                    if adapter is None or not adapter.retired or adapter.refs:
                        continue
                if adapter.resident:
                    self._take_out(name, adapter)
                with self._lock:
                    if self._adapters.get(name) is adapter:
                        del self._adapters[name]
