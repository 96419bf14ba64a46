"""ImageNet-1K (ImageFolder or local Hugging Face parquet) with the DeiT recipe's augmentation: Table A."""
