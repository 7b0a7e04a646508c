"""The ground floor: what every layer above may use and that imports nothing of the package.

``paths`` (local folders and ``gs://`` URIs behind one type), ``special_ids`` (pad/EOS/BOS/unk),
``sharding`` (the device mesh and the logical-axis rules), ``checkpoints`` (Orbax save, restore,
step choice and averaging), ``hub`` (a Hugging Face hub id or a local folder).
"""
