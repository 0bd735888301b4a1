// Directive editor: formatting, error location by directive index / field, and the line-number gutter.
#include "piper/gui/directive_editor.hpp"

#include <algorithm>
#include <cctype>

#include <QPaintEvent>
#include <QPainter>
#include <QTextBlock>

#include "piper/core/limits.hpp"

namespace piper::gui {

std::string format_directive(const nlohmann::json& value) {
  // nlohmann's dump() is either minified or one key per line: write the readable middle ground.
  if (value.is_object()) {
    if (value.empty()) return "{}";
    std::string out = "{";
    bool first = true;
    if (value.contains("op")) {  // a directive reads from its op
      out += "\"op\": " + format_directive(value["op"]);
      first = false;
    }
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (it.key() == "op") continue;
      if (!first) out += ", ";
      first = false;
      out += nlohmann::json(it.key()).dump() + ": " + format_directive(it.value());
    }
    return out + "}";
  }
  if (value.is_array()) {
    if (value.empty()) return "[]";
    std::string out = "[";
    for (std::size_t i = 0; i < value.size(); ++i) {
      if (i) out += ", ";
      out += format_directive(value[i]);
    }
    return out + "]";
  }
  return value.dump();
}

std::string format_program(const nlohmann::json& program) {
  if (!program.is_array()) return program.dump(2) + "\n";
  std::string out = "[\n";
  for (std::size_t i = 0; i < program.size(); ++i)
    out += "  " + format_directive(program[i]) + (i + 1 < program.size() ? ",\n" : "\n");
  return out + "]\n";
}

std::vector<std::pair<std::size_t, std::size_t>> top_level_elements(const std::string& text) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  int depth = 0;
  bool in_string = false, escaped = false;
  std::size_t begin = std::string::npos;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (depth == 1 && begin == std::string::npos && c != ',' && c != ']' &&
        !std::isspace(static_cast<unsigned char>(c)))
      begin = i;
    if (c == '"')
      in_string = true;
    else if (c == '[' || c == '{')
      ++depth;
    else if (c == ']' || c == '}') {
      --depth;
      if (depth == 0 && begin != std::string::npos) {  // the closing bracket of the program
        out.emplace_back(begin, i);
        begin = std::string::npos;
      }
    }
    if (depth == 1 && c == ',' && begin != std::string::npos) {
      out.emplace_back(begin, i);
      begin = std::string::npos;
    }
  }
  return out;
}

int line_of_offset(const std::string& text, std::size_t offset) {
  offset = std::min(offset, text.size());
  return static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(offset), '\n'));
}

int directive_line(const std::string& text, int index, const std::string& field) {
  const auto elements = top_level_elements(text);
  if (index < 0 || index >= static_cast<int>(elements.size())) return -1;
  const auto [begin, end] = elements[static_cast<std::size_t>(index)];
  if (!field.empty()) {
    // "filters[2].PP" -> look for the last plain key name ("PP"), else the first.
    std::string key = field.substr(0, field.find_first_of(".["));
    const auto found = text.find("\"" + key + "\"", begin);
    if (found != std::string::npos && found < end) return line_of_offset(text, found);
  }
  return line_of_offset(text, begin);
}

JsonCheck check_json(const std::string& text) {
  JsonCheck c;
  try {
    core::check_json_depth(text, "");
  } catch (const core::LimitError& e) {
    c.ok = false;
    c.line = 0;
    c.message = e.what();
    return c;
  }
  try {
    c.value = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    c.ok = false;
    c.line = line_of_offset(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    const auto colon = what.rfind(": ");
    c.message = "JSON syntax error: " + (colon == std::string::npos ? what : what.substr(colon + 2));
    return c;
  }
  if (!c.value.is_array()) {
    c.ok = false;
    c.line = 0;
    c.message = "a directive program must be a JSON array of directives";
  }
  return c;
}

namespace {
class LineNumbers : public QWidget {
 public:
  explicit LineNumbers(DirectiveEditor* editor) : QWidget(editor), editor_(editor) {}
  QSize sizeHint() const override { return {editor_->line_number_width(), 0}; }

 protected:
  void paintEvent(QPaintEvent* e) override { editor_->paint_line_numbers(e); }

 private:
  DirectiveEditor* editor_;
};
}  // namespace

DirectiveEditor::DirectiveEditor(QWidget* parent) : QPlainTextEdit(parent) {
  QFont mono("Monospace");
  mono.setStyleHint(QFont::TypeWriter);
  mono.setPointSizeF(9);
  setFont(mono);
  // Long directives wrap at the pane's edge (never cut off); the gutter numbers directives' lines.
  setLineWrapMode(QPlainTextEdit::WidgetWidth);
  setWordWrapMode(QTextOption::WrapAtWordBoundaryOrAnywhere);
  numbers_ = new LineNumbers(this);
  connect(this, &QPlainTextEdit::blockCountChanged, this, [this] { setViewportMargins(line_number_width(), 0, 0, 0); });
  connect(this, &QPlainTextEdit::updateRequest, this, [this](const QRect& r, int dy) {
    if (dy)
      numbers_->scroll(0, dy);
    else
      numbers_->update(0, r.y(), numbers_->width(), r.height());
  });
  setViewportMargins(line_number_width(), 0, 0, 0);
}

int DirectiveEditor::line_number_width() const {
  int digits = 1;
  for (int n = std::max(1, blockCount()); n >= 10; n /= 10) ++digits;
  return 10 + fontMetrics().horizontalAdvance(QLatin1Char('9')) * std::max(digits, 2);
}

void DirectiveEditor::resizeEvent(QResizeEvent* e) {
  QPlainTextEdit::resizeEvent(e);
  const QRect cr = contentsRect();
  numbers_->setGeometry(QRect(cr.left(), cr.top(), line_number_width(), cr.height()));
}

void DirectiveEditor::paint_line_numbers(QPaintEvent* e) {
  QPainter p(numbers_);
  p.fillRect(e->rect(), QColor(0xF2, 0xF2, 0xF2));
  QTextBlock block = firstVisibleBlock();
  int number = block.blockNumber();
  int top = qRound(blockBoundingGeometry(block).translated(contentOffset()).top());
  int bottom = top + qRound(blockBoundingRect(block).height());
  while (block.isValid() && top <= e->rect().bottom()) {
    if (block.isVisible() && bottom >= e->rect().top()) {
      const bool bad = number == error_line_;
      if (bad) p.fillRect(0, top, numbers_->width(), bottom - top, QColor(0xD0, 0x20, 0x20));
      p.setPen(bad ? Qt::white : QColor(0x90, 0x90, 0x90));
      p.drawText(0, top, numbers_->width() - 4, fontMetrics().height(), Qt::AlignRight, QString::number(number + 1));
    }
    block = block.next();
    top = bottom;
    bottom = top + qRound(blockBoundingRect(block).height());
    ++number;
  }
}

void DirectiveEditor::set_error(int line, const QString& message) {
  error_line_ = line;
  error_message_ = message;
  QList<QTextEdit::ExtraSelection> marks;
  if (line >= 0) {
    QTextEdit::ExtraSelection sel;
    sel.format.setBackground(QColor(0xFF, 0xE0, 0xE0));
    sel.format.setProperty(QTextFormat::FullWidthSelection, true);
    sel.cursor = QTextCursor(document()->findBlockByNumber(line));
    marks << sel;
    QTextEdit::ExtraSelection underline;
    underline.format.setUnderlineStyle(QTextCharFormat::WaveUnderline);
    underline.format.setUnderlineColor(Qt::red);
    underline.cursor = QTextCursor(document()->findBlockByNumber(line));
    underline.cursor.movePosition(QTextCursor::EndOfBlock, QTextCursor::KeepAnchor);
    marks << underline;
  }
  setExtraSelections(marks);
  numbers_->update();
}

void DirectiveEditor::clear_error() {
  set_error(-1, {});
  error_message_.clear();
}

}  // namespace piper::gui
