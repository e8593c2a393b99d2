"""The `Problem` facade (`problem`), its arguments (`arguments`), the checks it makes as
it is made (`construction`), its calls one at a time (`locking`), the running of its
programs (`execution`), its inputs (`inputs`, `trees`), and samples split over the ranks
(`shard`).

The top layer: may import every other."""
