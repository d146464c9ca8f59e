"""The lab's semantic slice: training, evaluation, cards, its report section and its `kvstate semantic` commands."""
