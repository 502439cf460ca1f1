"""``huggingface_hub``'s side of the Hub store, light to import.

* :mod:`fsm.hub.client`: each Hub call the adapter makes, as a call of the library, with
  the digest checks the library does not make;
* :mod:`fsm.hub.library`: loading the library (its transfer switch first), its settings,
  and how a failure of it reads;
* :mod:`fsm.hub.agent`: the process those calls are made in, started at the runner's
  first instruction so the library loads beside the runner's own start.

The adapter (bounds, retries, the fence) is ``fsm.store.hub``. Nothing here imports more
than the standard library until the library itself is loaded.
"""
