"""The RL math, pure functions of tensors: advantage estimators (``advantages``) and the policy
and value losses with their importance-sampling corrections (``losses``). Nothing here knows a
store, a model or Lightning."""
