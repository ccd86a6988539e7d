"""HTTP endpoints, one APIRouter per file."""
