// Chrome trace reader (the format core::write_chrome_trace writes, and runtimes' measured traces):
// complete "X" events become lanes of a measured Track, which can be overlaid on a predicted one.
#pragma once

#include <memory>
#include <string>

#include "piper/gui/timeline_data.hpp"

namespace piper::gui {

// Reads a Chrome trace JSON file: one row per process (device N from a "device N" process name, else
// the pid), one lane per thread, spans from "X" events (and matched "B"/"E" pairs). Throws core::Error
// with one line naming the file.
std::shared_ptr<Track> read_chrome_trace(const std::string& path, const std::string& title = "");
std::shared_ptr<Track> parse_chrome_trace(const std::string& json_text, const std::string& where,
                                          const std::string& title = "");

// Matches measured lane `lane` of `track.rows[row]` with the predicted lane of stream `stream` on the
// same row: the k-th measured span named L is the k-th predicted op labelled L. Fills the lane's
// predicted_lane, predicted_pos and error (overlay_measured calls it for every lane it adds).
void match_measured_lane(Track& track, int row, int lane, const std::string& stream);

// Appends the measured track's lanes under the predicted lanes of the same device (rows that the
// predicted track lacks are added), so predicted and measured spans share the time axis.
void overlay_measured(Track& predicted, const Track& measured);

}  // namespace piper::gui
