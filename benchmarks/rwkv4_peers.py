"""RWKV-4 beside transformers and ChatRWKV: :mod:`aftlab.bench.rwkv4_peers` (its docstring has
the options), also ``aftlab bench --suite rwkv4-peers``.

    python benchmarks/rwkv4_peers.py --shapes 169m,430m --repeats 3 --threads 2
"""

from aftlab.bench.rwkv4_peers import main

if __name__ == "__main__":
    main()
