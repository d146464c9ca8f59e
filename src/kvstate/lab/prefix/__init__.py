"""The lab's prefix slice: training, evaluation, cards, its report section and its `kvstate prefix` commands."""
