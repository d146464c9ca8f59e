"""kvstate.lab.models — the real pretrained model the lab measures on: fetched from the package registry,
converted once (``kvstate models convert``)."""
