// piper-studio: the timeline explorer's entry point (all logic is in piper_gui).
#include "piper/gui/studio_window.hpp"

int main(int argc, char** argv) { return piper::gui::studio_main(argc, argv); }
