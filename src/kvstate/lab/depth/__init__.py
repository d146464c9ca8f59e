"""The lab's depth slice: training, evaluation, cards, its report section and its `kvstate depth` commands."""
