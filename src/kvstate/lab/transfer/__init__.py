"""The lab's transfer slice: training, evaluation, cards, its report section and its `kvstate transfer` commands."""
