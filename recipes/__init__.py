"""Ready YAML recipes shipped with the package (see `compress run`)."""
from pathlib import Path

RECIPES_DIR = Path(__file__).parent
