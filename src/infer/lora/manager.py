"""Which adapter sits in which device slot, and which adapters are kept in host memory.

Two LRU caches, as in vLLM's ``LRUCacheWorkerLoRAManager`` and S-LoRA's unified memory pool:

* **host** (``max_cpu_loras`` adapters): an adapter read from disk (:func:`~infer.lora.adapter.load_adapter`)
  stays in host memory, float32, scale folded into B; the least recently used one is dropped when a
  new one comes;
* **device** (``max_loras`` slots): the adapters the next steps need are copied into the stacked slot
  buffers of every :class:`~infer.lora.layers.LoRALinear`. A slot whose adapter is used by a *running*
  request is never reused (the scheduler admits at most ``max_loras`` distinct adapters into the
  running set, so a free or reusable slot always exists for the adapters of a step); among the others
  the least recently used goes first.

The model runner turns each step's rows into slots (:meth:`LoRAModelManager.set_mapping`) after the
engine has made the step's adapters resident (:meth:`LoRAModelManager.activate`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from infer.config import ModelConfig
from infer.lora.adapter import LoRAAdapter, load_adapter
from infer.lora.layers import LoRAMapping, add_lora_layers
from infer.lora.request import LoRARequest


class LoRAModelManager:
    """The LoRA slots of one model and the host cache in front of them.

    Args:
        model: the :class:`~infer.models.layers.CausalLM` (its projections are wrapped here).
        config: its :class:`~infer.config.ModelConfig` (the shapes adapters must have).
        max_loras, max_lora_rank, max_cpu_loras: ``EngineConfig``'s.
        ops: the module whose ``add_lora`` runs the kernels (:func:`infer.kernels.lora_ops`).

    Attributes:
        slots: ``[max_loras]`` the ``lora_int_id`` in each slot, or None.
        num_slot_loads, num_disk_loads: adapters copied into a slot, read from disk, so far.
    """

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, ops) -> None:
        self.config = config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = next(model.parameters()).device
        self.mapping = LoRAMapping(ops, max_loras, self.device, max_lora_rank)
        self.layers = add_lora_layers(model, max_loras, max_lora_rank, self.mapping)
        self.slots: list[int | None] = [None] * max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.num_slot_loads = self.num_disk_loads = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slot buffers on the device."""
        return sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.layers.values())

    # ------------------------------------------------------------------ host cache

    def get_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request``, from the host cache or read from disk (then cached).

        Raises:
            ValueError: the adapter cannot be served (:func:`~infer.lora.adapter.load_adapter`'s reasons),
                or its ``lora_int_id`` is already the id of an adapter with another name or path.
        """
        cached = self._host.get(request.lora_int_id)
        if cached is not None:
            if (cached.name, cached.path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {cached.name!r} ({cached.path}); "
                                 f"{request.lora_name!r} ({request.lora_path}) needs an id of its own")
            self._host.move_to_end(request.lora_int_id)
            return cached
        adapter = load_adapter(request.lora_path, self.config, self.max_lora_rank, request.lora_name,
                               request.lora_int_id)
        self.num_disk_loads += 1
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def is_cached(self, lora_int_id: int) -> bool:
        return lora_int_id in self._host

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: its host copy and its slot (the caller makes sure no request uses it).
        Returns False if it was neither cached nor resident."""
        found = self._host.pop(lora_int_id, None) is not None
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
            found = True
        return found

    # ------------------------------------------------------------------ device slots

    def slot_of(self, lora_int_id: int) -> int:
        """The slot ``lora_int_id`` is resident in (after :meth:`activate`)."""
        return self._slot_of[lora_int_id]

    def activate(self, requests: Iterable[LoRARequest], in_use: set[int]) -> None:
        """Make every adapter of ``requests`` resident in a slot.

        Args:
            requests: the adapters the next step runs.
            in_use: ``lora_int_id`` s of the running requests: their slots are never reused.

        Raises:
            RuntimeError: more distinct adapters in use than slots (the scheduler prevents it).
        """
        for req in {r.lora_int_id: r for r in requests}.values():
            rid = req.lora_int_id
            if rid in self._slot_of:
                self._slot_of.move_to_end(rid)
                continue
            adapter = self.get_adapter(req)
            slot = self._free_slot(in_use)
            self._load(slot, adapter)

    def _free_slot(self, in_use: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for rid, slot in self._slot_of.items():  # least recently used first
            if rid not in in_use:
                del self._slot_of[rid]
                self.slots[slot] = None
                return slot
        raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running requests; the scheduler "
                           "must not run more distinct adapters than max_loras")

    @torch.inference_mode()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, layer in self.layers.items():
            layer.set_slot(slot, adapter.weights.get(key))
        self.mapping.slot_ranks[slot] = adapter.rank  # the kernels read no further (its padding is zeros)
        self.slots[slot] = adapter.int_id
        self._slot_of[adapter.int_id] = slot
        self.num_slot_loads += 1

    def set_mapping(self, token_slots: list[int]) -> None:
        """The step's slot of each row (``[T]``, -1: no adapter), read by every LoRA layer."""
        self.mapping.set(token_slots, self.device)
