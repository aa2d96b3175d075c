"""Input checks and keyword handling the op families share with every backend (native and
fla's): :mod:`.gla` and :mod:`.deltanet`. Apart from the op packages, whose ``__init__``
dispatches to the backends, so that a backend imports its checks without importing them."""
