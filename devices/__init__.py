"""Device workers: one thread per rank, its stream, state, graphs and collectives."""
