"""Where every row lives: the precision policy, the strategy, buckets, gather units and the
static shard layout built from them."""
