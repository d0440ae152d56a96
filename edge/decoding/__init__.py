"""The edge's decoding: a generation's rounds against the cloud, pipelined or not."""
