"""ADE20K semantic segmentation (Table C): the release loader with the Segmenter pipelines and a tiny fake copy."""
