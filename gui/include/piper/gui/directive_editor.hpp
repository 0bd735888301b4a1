// The directive program editor: a JSON text pane with line numbers, whose errors (JSON syntax, or a
// core::DirectiveError's directive index and field) are marked at their line.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <QPlainTextEdit>

#include <nlohmann/json.hpp>

namespace piper::gui {

// One directive per line ("[\n  {...},\n  {...}\n]"), so directive i is on line i + 2; each written
// as JSON with a space after every ':' and ',' ({"op": "place", "devices": [0, 1]}).
std::string format_program(const nlohmann::json& program);
std::string format_directive(const nlohmann::json& directive);
// [begin, end) byte offsets of the top-level array elements of `text` (strings and nesting respected).
std::vector<std::pair<std::size_t, std::size_t>> top_level_elements(const std::string& text);
int line_of_offset(const std::string& text, std::size_t offset);  // 0-based
// Line (0-based) of directive `index`, or of its `field` key inside it when found; -1 if unknown.
int directive_line(const std::string& text, int index, const std::string& field);

struct JsonCheck {
  bool ok = true;
  int line = -1;  // 0-based line of a syntax error
  std::string message;
  nlohmann::json value;
};
JsonCheck check_json(const std::string& text);

class DirectiveEditor : public QPlainTextEdit {
  Q_OBJECT

 public:
  explicit DirectiveEditor(QWidget* parent = nullptr);
  // Marks `line` (0-based; -1: no line) with `message`; clear_error() removes it.
  void set_error(int line, const QString& message);
  void clear_error();
  int error_line() const { return error_line_; }
  const QString& error_message() const { return error_message_; }
  int line_number_width() const;
  void paint_line_numbers(QPaintEvent* e);

 protected:
  void resizeEvent(QResizeEvent* e) override;

 private:
  QWidget* numbers_ = nullptr;
  int error_line_ = -1;
  QString error_message_;
};

}  // namespace piper::gui
