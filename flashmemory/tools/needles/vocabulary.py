"""The words the needle tasks draw keys and values from (plain English, mostly one token each,
so the needle is not the only odd text in the haystack)."""

# fmt: off
# Keys and word values of every task (the separate layout draws only these).
WORDS = (
    "apple", "anchor", "badger", "banner", "candle", "canyon", "cobalt", "copper", "dolphin",
    "ember", "falcon", "fern", "garnet", "glacier", "harbor", "hazel", "island", "ivory",
    "jasmine", "juniper", "kettle", "lantern", "lemon", "marble", "meadow", "nickel", "orchid",
    "otter", "pepper", "pillow", "quartz", "raven", "ribbon", "saddle", "salmon", "tulip",
    "timber", "velvet", "walnut", "willow", "yarrow", "zephyr", "basket", "cactus", "dragon",
    "feather", "granite", "helmet", "igloo", "jigsaw",
)

# More keys for a shared haystack, where no two needles may share one.
MORE_WORDS = (
    "acorn", "beacon", "bramble", "button", "cabin", "chisel", "clover", "compass", "cricket",
    "daisy", "dune", "easel", "fiddle", "goblet", "gravel", "hammock", "hollow", "jacket",
    "kayak", "ladder", "locket", "magnet", "mitten", "nutmeg", "oyster", "paddle", "parcel",
    "pebble", "puzzle", "quiver", "rocket", "rudder", "satchel", "shovel", "spindle",
    "sprocket", "tassel", "thimble", "trumpet", "tunnel", "umbrella", "valley", "wagon",
    "whistle", "wicket", "yogurt", "zipper", "bonnet", "cushion", "dagger",
)

# aggregation: a category and its items (none of them a key word)
TALLIES = {
    "colour": ("crimson", "indigo", "amber", "teal", "scarlet", "violet", "ochre", "magenta"),
    "animal": ("heron", "bison", "lynx", "walrus", "gecko", "moose", "ferret", "panda"),
    "fruit": ("mango", "papaya", "guava", "cherry", "plum", "apricot", "lychee", "quince"),
    "metal": ("tin", "chrome", "iron", "bronze", "pewter", "silver", "platinum", "tungsten"),
    "instrument": ("violin", "oboe", "cello", "tuba", "flute", "harp", "banjo", "bassoon"),
    "vegetable": ("carrot", "turnip", "parsnip", "leek", "radish", "celery", "spinach", "okra"),
    "gemstone": ("topaz", "opal", "jade", "ruby", "onyx", "pearl", "amethyst", "emerald"),
    "tree": ("oak", "maple", "birch", "cedar", "aspen", "spruce", "poplar", "larch"),
}

FIRST_NAMES = (
    "Marta", "Oskar", "Ines", "Tobias", "Greta", "Milan", "Sofia", "Anton", "Leona", "Viktor",
    "Clara", "Emil", "Nadia", "Hugo", "Paula", "Felix",
)

LAST_NAMES = (
    "Quell", "Brandt", "Ferreira", "Novak", "Lindqvist", "Moreau", "Kowalski", "Haddad",
    "Okafor", "Sato", "Varga", "Castell", "Ducret", "Rinaldi", "Petrov", "Amsel",
)

CITIES = (
    "Lisbon", "Tallinn", "Porto", "Krakow", "Ghent", "Bergen", "Toulouse", "Bologna", "Graz",
    "Utrecht", "Seville", "Lyon", "Aarhus", "Brno", "Turin", "Malmo",
)

ROLES = (
    "pilot", "baker", "surgeon", "tailor", "lawyer", "farmer", "plumber", "chemist",
    "sculptor", "librarian", "welder", "florist",
)
# fmt: on
