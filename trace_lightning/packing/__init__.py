"""A tree laid out as one sequence, below allocation, training and the callbacks, which all
read it: leaves packed into token-budget micro-batches (``leaves``), a tree's tokens forwarded
once with its leaves' weights (``trees``), the attention that keeps each token to its
ancestors (``attention``) and the (leaf, token) pairs of a packed batch (``pairs``)."""
